"""MNIST as Spark DataFrames, and the extended (distorted) MNIST generated on the executors.

Rows: ``features`` array<float> (784 values in [0, 1], row-major 28×28) and ``label`` long;
extended MNIST is generated as ``features`` binary (784 uint8 pixels a row, a quarter of the
bytes, scaled to [0, 1] per mini-batch by the bridge) unless asked for floats.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..compat import broadcast, create_from_arrow
from ..errors import DataError
from .distort import Distortion, distort_range
from .idx import load_mnist

__all__ = ["MNIST_SCHEMA", "PIXEL_SCHEMA", "arrays_to_arrow", "extended_mnist", "mnist_dataframe",
           "mnist_file_dataframe", "mnist_split", "pixels_to_arrow"]

MNIST_SCHEMA = "features array<float>, label long"
PIXEL_SCHEMA = "features binary, label long"


def mnist_split(images: str | Path, labels: str | Path, n_train: int = 8000, n_test: int = 2000):
    """(train_x, train_y), (test_x, test_y): the first ``n_train`` and the last ``n_test``."""
    x, y = load_mnist(images, labels)
    if n_train + n_test > len(x):
        raise DataError(f"n_train + n_test = {n_train + n_test} exceeds the {len(x)} digits in "
                        f"{images}; lower them so the splits do not overlap")
    return (x[:n_train], y[:n_train]), (x[len(x) - n_test:], y[len(y) - n_test:])


def arrays_to_arrow(features: np.ndarray, labels: np.ndarray) -> pa.RecordBatch:
    """(n, ...) float features + (n,) labels -> RecordBatch(features list<float>, label int64)."""
    n = len(features)
    flat = np.ascontiguousarray(features, dtype=np.float32).reshape(-1)
    if flat.size >= 2**31:
        raise ValueError(f"{flat.size} values exceed one Arrow list array's int32 offsets; "
                         f"pass at most {(2**31 - 1) // max(flat.size // max(n, 1), 1)} rows")
    dim = flat.size // n if n else 0
    offsets = pa.array(np.arange(0, (n + 1) * dim, dim, dtype=np.int32) if n else [0],
                       pa.int32())
    col = pa.ListArray.from_arrays(offsets, pa.array(flat, pa.float32()))
    return pa.RecordBatch.from_arrays([col, pa.array(labels.astype(np.int64))],
                                      ["features", "label"])


def _binary_rows(pixels: np.ndarray) -> pa.Array:
    """(n, ...) uint8 -> a binary array, one row's bytes each, from the array's buffer."""
    if pixels.dtype != np.uint8:
        raise TypeError(f"pixels must be uint8, got {pixels.dtype}; scale and round floats "
                        f"(np.rint(x * 255).astype(np.uint8)) or use arrays_to_arrow")
    n = len(pixels)
    flat = np.ascontiguousarray(pixels).reshape(-1)
    dim = flat.size // n if n else 0
    if flat.size >= 2**31:
        raise ValueError(f"{flat.size} bytes exceed one Arrow binary array's int32 offsets; "
                         f"pass at most {(2**31 - 1) // max(dim, 1)} rows")
    offsets = np.arange(0, (n + 1) * dim, dim, dtype=np.int32) if n else np.zeros(1, np.int32)
    return pa.BinaryArray.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                        pa.py_buffer(flat)])


def pixels_to_arrow(pixels: np.ndarray, labels: np.ndarray) -> pa.RecordBatch:
    """(n, ...) uint8 images + (n,) labels -> RecordBatch(features binary, label int64): one
    image's bytes a row, built from the array's buffer without per-row objects."""
    return pa.RecordBatch.from_arrays([_binary_rows(pixels),
                                       pa.array(np.asarray(labels).astype(np.int64))],
                                      ["features", "label"])


def images_to_arrow(images: np.ndarray, targets: np.ndarray, **columns) -> pa.RecordBatch:
    """(n, ...) uint8 images + (n, ...) float targets (density maps, masks) ->
    RecordBatch(features binary, label list<float>, then ``columns``, one value a row)."""
    n = len(images)
    flat = np.ascontiguousarray(targets, dtype=np.float32).reshape(-1)
    m = flat.size // n if n else 0
    label = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * m, m, dtype=np.int32)),
                                     pa.array(flat, pa.float32()))
    return pa.RecordBatch.from_arrays(
        [_binary_rows(images), label, *(pa.array(v) for v in columns.values())],
        ["features", "label", *columns])


def mnist_dataframe(spark, images: np.ndarray, labels: np.ndarray, partitions: int = 2):
    """A DataFrame of real digits (uint8 images scaled to [0, 1]), built from Arrow."""
    table = pa.Table.from_batches([arrays_to_arrow(images.reshape(len(images), -1) / 255.0,
                                                   labels)])
    return create_from_arrow(spark, table).repartition(partitions)


def mnist_file_dataframe(spark, images: str | Path, labels: str | Path, lo: int, hi: int,
                         partitions: int = 2):
    """Digits lo..hi of an IDX file pair as a DataFrame (features scaled to [0, 1]); every
    partition reads its own slice from the files inside an executor, so the driver holds none
    (the files must be readable there)."""
    if not 0 <= lo < hi or partitions < 1:
        raise ValueError(f"need 0 <= lo < hi and partitions >= 1, got lo={lo}, hi={hi}, "
                         f"partitions={partitions}")
    images, labels = str(images), str(labels)

    def _read_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        x, y = load_mnist(images, labels)
        if hi > len(x):
            raise DataError(f"{images} holds {len(x)} digits, fewer than hi={hi}")
        for b in batches:
            for i in b.column("id").to_numpy():
                a, z = lo + i * (hi - lo) // partitions, lo + (i + 1) * (hi - lo) // partitions
                yield arrays_to_arrow(x[a:z].reshape(z - a, -1) / 255.0, y[a:z])
    return spark.range(partitions, numPartitions=partitions).mapInArrow(_read_task,
                                                                       MNIST_SCHEMA)


def extended_mnist(spark, images: np.ndarray, labels: np.ndarray, n: int, partitions: int,
                   seed: int = 0, distortion: Distortion = Distortion(), dtype: str = "uint8"):
    """``n`` distorted digits, generated partition by partition inside the executors.

    The source digits (N, 28, 28) uint8 travel once per executor as a broadcast variable
    (under Spark Connect, in the generating function);
    sample i depends only on (source, seed, i), never on ``partitions``. ``dtype`` "uint8":
    ``features`` binary, the digit rounded to 784 pixel bytes (PIXEL_SCHEMA); "float32":
    array<float> in [0, 1] (MNIST_SCHEMA), four times the bytes.
    """
    if dtype not in ("uint8", "float32"):
        raise ValueError(f"dtype must be 'uint8' or 'float32', got {dtype!r}")
    if images.ndim != 3 or len(images) != len(labels) or len(images) == 0:
        raise DataError(f"extended_mnist needs images (N, H, W) and N labels, N >= 1; got "
                        f"{images.shape} and {labels.shape}")
    if n < 0 or partitions < 1:
        raise ValueError(f"n must be >= 0 and partitions >= 1, got n={n}, partitions={partitions}")
    source = broadcast(spark, (np.ascontiguousarray(images), np.asarray(labels)))

    def _generate_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Runs on executors: one Arrow batch of sample ids -> the same rows of digits.
        import torch
        torch.set_num_threads(1)
        src_x, src_y = source.value
        for b in batches:
            ids = b.column(0).to_numpy()
            if len(ids) == 0:
                continue
            lo, hi = int(ids.min()), int(ids.max()) + 1
            x, y = distort_range(src_x, src_y, lo, hi, seed, distortion)
            if hi - lo != len(ids):
                x, y = x[ids - lo], y[ids - lo]
            if dtype == "uint8":
                yield pixels_to_arrow(to_pixels(x), y)
            else:
                yield arrays_to_arrow(x, y)

    ids = spark.range(0, n, 1, numPartitions=partitions)
    return ids.mapInArrow(_generate_task, PIXEL_SCHEMA if dtype == "uint8" else MNIST_SCHEMA)


def to_pixels(x: np.ndarray) -> np.ndarray:
    """Floats in [0, 1] -> the nearest uint8 pixel values."""
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)
