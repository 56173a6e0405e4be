"""MNIST IDX files (gzip or raw), validated.

IDX layout: 2 zero bytes, a type byte (0x08 = uint8), the number of dimensions, then one
big-endian uint32 per dimension and the data. MNIST images have magic 2051 (3 dims), labels
magic 2049 (1 dim).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from ..errors import DataError

__all__ = ["IMAGES_MAGIC", "LABELS_MAGIC", "load_mnist", "read_idx"]

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
_GZIP = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise DataError(f"IDX file {path} does not exist")
    raw = path.read_bytes()
    if raw[:2] == _GZIP:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: corrupt or truncated gzip stream ({e}); "
                            f"re-copy the file") from e
    return raw


def read_idx(path: str | Path, expect_magic: int | None = None) -> np.ndarray:
    """Read an IDX uint8 array of any rank; ``expect_magic`` checks the file's kind."""
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    zeros, dtype, ndim = raw[:2], raw[2], raw[3]
    if zeros != b"\0\0" or dtype != 0x08 or ndim == 0:
        raise DataError(f"{path}: bad IDX magic number {magic} (0x{magic:08x}); expected an "
                        f"unsigned-byte IDX file such as MNIST images (2051) or labels (2049)")
    if expect_magic is not None and magic != expect_magic:
        raise DataError(f"{path}: IDX magic number {magic}, expected {expect_magic} "
                        f"({'images' if expect_magic == IMAGES_MAGIC else 'labels'}); "
                        f"are the image and label files swapped?")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header})")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(dims))
    if len(raw) - header != size:
        raise DataError(f"{path}: IDX header says {dims} = {size} bytes of data, file holds "
                        f"{len(raw) - header}; the file is truncated or corrupt, re-copy it")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load_mnist(images: str | Path, labels: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) int64, checked to match."""
    x = read_idx(images, IMAGES_MAGIC)
    y = read_idx(labels, LABELS_MAGIC)
    if x.ndim != 3 or y.ndim != 1:
        raise DataError(f"MNIST images must be 3-D and labels 1-D, got {x.shape} and {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{images} holds {len(x)} images but {labels} holds {len(y)} labels; "
                        f"use the label file that belongs to these images")
    if y.size and y.max() > 9:
        raise DataError(f"{labels}: label {int(y.max())} out of range 0-9")
    return x, y.astype(np.int64)
