"""One partition's Arrow record batches -> a stream of torch mini-batches.

This is the bridge every engine uses inside its Spark tasks (``df.mapInArrow(task)``): the
partition is read once into contiguous numpy arrays straight from the Arrow buffers (no per-row
Python objects), validated (nulls, ragged rows, NaN/inf, label range), and then served as
shuffled mini-batches per epoch.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch

from ..errors import DataError

__all__ = ["ShardData", "column_to_numpy"]


def column_to_numpy(col: pa.Array | pa.ChunkedArray | Sequence[pa.Array], name: str,
                    shape: Sequence[int] = (), where: str = "partition") -> np.ndarray:
    """Arrow column (one array, a chunked array or a list of chunks) -> numpy (n, *shape).

    Scalar columns (shape ``()``) keep their numeric kind (integers -> int64, floats ->
    float32); list / fixed-size-list columns of numbers become float32 rows of
    ``prod(shape)`` values, reshaped to ``shape``. The chunks are validated as zero-copy views
    of the Arrow buffers and copied once into one writable array.
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else \
        [col] if isinstance(col, pa.Array) else list(col)
    views, row0 = [], 0
    for chunk in chunks:
        views.append(_chunk_view(chunk, name, shape, where, row0))
        row0 += len(chunk)
    if not views:
        return np.zeros((0, *shape), np.float32)
    widths = {v.shape[1:] for v in views}
    if len(widths) > 1:
        raise DataError(f"column '{name}': rows of the {where} have different lengths "
                        f"{sorted(w[0] for w in widths)}; give shape= or fix the ragged rows")
    dtype = np.float32 if views[0].dtype.kind == "f" else np.int64
    out = np.empty((row0, *views[0].shape[1:]), dtype)
    r = 0
    for v in views:                      # the one copy: Arrow memory -> a writable array
        out[r:r + len(v)] = v
        r += len(v)
    return out


def _chunk_view(col: pa.Array, name: str, shape: Sequence[int], where: str, row0: int):
    """One Arrow chunk -> a (possibly read-only) numpy view, validated; rows numbered from row0."""
    n = len(col)
    if col.null_count:
        row = row0 + int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"column '{name}' has a null at row {row} of the {where}; "
                        f"drop or fill missing rows before training (df.dropna(subset=['{name}']))")
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if pa.types.is_fixed_size_list(t):
            lengths = np.full(n, t.list_size)
        else:
            lengths = np.diff(col.offsets.to_numpy())
        want = int(np.prod(shape)) if len(shape) else (int(lengths[0]) if n else 0)
        bad = np.flatnonzero(lengths != want)
        if len(bad):
            r = int(bad[0])
            raise DataError(f"column '{name}': row {row0 + r} of the {where} has "
                            f"{int(lengths[r])} values, expected {want} (shape "
                            f"{tuple(shape) or (want,)}); rows must all have the same length; "
                            f"fix or filter the ragged rows")
        values = col.flatten()
        if values.null_count:
            raise DataError(f"column '{name}' holds null elements inside its arrays in the "
                            f"{where}; fill them before training")
        if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
            raise DataError(f"column '{name}' holds arrays of {values.type}; expected numbers")
        arr = values.to_numpy(zero_copy_only=False)
        arr = arr.reshape((n, *shape) if len(shape) else (n, want))
        if arr.dtype.kind != "f":
            arr = arr.astype(np.float32)
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        arr = col.to_numpy()
        if len(shape):
            raise DataError(f"column '{name}' holds scalars but shape {tuple(shape)} was "
                            f"given; use an array column or drop the shape")
    else:
        raise DataError(f"column '{name}' has Arrow type {t}; expected numbers or arrays of "
                        f"numbers (array<float> or an ML vector converted with vector_to_array)")
    # Fast path: a finite sum means every value is finite; otherwise find the row.
    if arr.dtype.kind == "f" and n and not np.isfinite(arr.sum()):
        finite = np.isfinite(arr.reshape(n, -1)).all(axis=1)
        if not finite.all():
            r = row0 + int(np.flatnonzero(~finite)[0])
            raise DataError(f"column '{name}': row {r} of the {where} holds NaN or inf; "
                            f"clean the data (e.g. filter with isnan) before training")
    return arr


class ShardData:
    """The rows of one partition as torch-ready arrays.

    features: (n, *shape) float32; labels: (n,) int64 for classes, float32 for targets, or
    None. ``batches()`` yields ``(x, y)`` torch tensors.
    """

    def __init__(self, features: np.ndarray, labels: np.ndarray | None = None):
        if labels is not None and len(labels) != len(features):
            raise ValueError(f"features has {len(features)} rows but labels {len(labels)}")
        self.features, self.labels = features, labels

    @classmethod
    def from_arrow(cls, batches: Iterable[pa.RecordBatch], features: str = "features",
                   label: str | None = "label", shape: Sequence[int] = (),
                   label_shape: Sequence[int] = (), num_classes: int | None = None,
                   where: str = "partition") -> "ShardData":
        """Read all record batches of a partition (an empty partition gives 0 rows)."""
        batches = [b for b in batches if b.num_rows]
        cols = [features] + ([label] if label else [])
        for b in batches[:1]:
            missing = [c for c in cols if c not in b.schema.names]
            if missing:
                raise DataError(f"column(s) {missing} not found in the {where}; it has "
                                f"{b.schema.names}; set features=/label= to the right names")
        if not batches:
            dim = tuple(shape) if len(shape) else (0,)
            empty_y = np.zeros((0, *label_shape), np.int64 if not label_shape else np.float32)
            return cls(np.zeros((0, *dim), np.float32), empty_y if label else None)
        x = column_to_numpy([b.column(features) for b in batches], features, shape, where)
        y = None
        if label:
            y = column_to_numpy([b.column(label) for b in batches], label, label_shape, where)
            if num_classes is not None:
                if y.dtype.kind != "i":
                    raise DataError(f"column '{label}' must hold integer class ids for "
                                    f"num_classes={num_classes}, got {y.dtype}")
                bad = np.flatnonzero((y < 0) | (y >= num_classes))
                if len(bad):
                    r = int(bad[0])
                    raise DataError(f"column '{label}': row {r} of the {where} has label "
                                    f"{int(y[r])}, outside 0..{num_classes - 1}; fix the labels "
                                    f"or set num_classes")
        return cls(x, y)

    def __len__(self) -> int:
        return len(self.features)

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        n = len(self)
        return n // batch_size if drop_last else -(-n // batch_size)

    def batches(self, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Mini-batches of one epoch; the order depends only on (seed, epoch)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(self)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else None
        for start in range(0, self.num_batches(batch_size, drop_last) * batch_size, batch_size):
            if order is None:
                sel = slice(start, min(start + batch_size, n))       # zero-copy views
            else:
                sel = np.sort(order[start:start + batch_size])       # sorted: cache-friendly gather
            x = torch.from_numpy(self.features[sel])
            y = None if self.labels is None else torch.from_numpy(self.labels[sel])
            yield x, y
